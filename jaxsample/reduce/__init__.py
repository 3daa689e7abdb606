"""Reducing N branches to one answer."""
