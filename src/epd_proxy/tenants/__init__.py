"""Tenants: per-key limits and budgets, priority classes and fair shares, model aliases."""
