"""Tests for boost_hf.data."""
