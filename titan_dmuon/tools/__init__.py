"""Measuring tools the product offers beside it: the communication ledger.

May import: every layer below ``integration`` (it never imports TorchTitan).
"""
