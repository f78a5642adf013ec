"""Helpers the test suites share: local tokenizers and fixtures made on this machine."""
