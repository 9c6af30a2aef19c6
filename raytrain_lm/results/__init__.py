"""What a finished run gives a user: tables and reports (tables), the report's figure (plots),
sampling text (generate, torch) and export (export, torch)."""
