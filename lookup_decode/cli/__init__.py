"""The `lookup-decode` commands (`commands.main`): generate, chat (`chat`), bench (`bench`), run (the batch
job, `engines.batch`)."""
