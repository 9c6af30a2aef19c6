"""The model families: the decoder skeleton they share and one folder per family."""
