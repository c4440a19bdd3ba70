"""Checks: each compares one observable of the two sides and returns findings."""
