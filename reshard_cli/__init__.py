"""reshard: refit LLM weights between parallel layouts as a DTensor→DTensor redistribution."""

__version__ = "0.1.0"
