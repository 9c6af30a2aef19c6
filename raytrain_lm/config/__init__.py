"""What a run is, in pure Python (no Ray, no torch): its settings (settings.py), presets
(presets.py), loading them from a file, flags and --set (load.py), their checks (checks.py), the
parallel layout (layout.py: Layout), an elastic run's sizes (sizes.py) and what each worker is
given (inputs.py)."""
