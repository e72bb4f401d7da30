"""Command-line interface (click): parse, call the API, print. No model logic."""
