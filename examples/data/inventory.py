"""A tiny stock-keeping module (sample input for examples/code_edit.py)."""

import csv


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity, price):
        if quantity < 0:
            raise ValueError("quantity must be >= 0")
        if name in self.items:
            self.items[name]["quantity"] += quantity
            self.items[name]["price"] = price
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove(self, name, quantity):
        item = self.items[name]
        if quantity > item["quantity"]:
            raise ValueError(f"only {item['quantity']} of {name} in stock")
        item["quantity"] -= quantity
        if item["quantity"] == 0:
            del self.items[name]

    def total_value(self):
        return sum(item["quantity"] * item["price"] for item in self.items.values())

    def low_stock(self, threshold=5):
        return sorted(name for name, item in self.items.items() if item["quantity"] < threshold)


def load_csv(path):
    inventory = Inventory()
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            inventory.add(row["name"], int(row["quantity"]), float(row["price"]))
    return inventory
