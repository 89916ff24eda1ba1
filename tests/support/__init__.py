"""Helpers shared by the test modules (and bench/, which puts tests/ on sys.path): no tests here."""
