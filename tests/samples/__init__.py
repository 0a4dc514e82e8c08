"""Tests of the samples (samples/chat.py)."""
