"""Reusable Pulumi components and the pure deciders behind them."""
