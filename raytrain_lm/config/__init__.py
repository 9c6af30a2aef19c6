"""What a run is: its settings (settings.py), presets (presets.py), loading them from a file, flags
and --set (load.py), their checks (checks.py) and the layout arithmetic (sizes.py). Pure Python: no
Ray, no torch."""
