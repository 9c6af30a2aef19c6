"""Every byte on disk or in a bucket: file names (files), local/s3:// / gs:// storage and staged
folders (storage), claims on a run folder (claims), finding runs and checkpoints (runs), the
checkpoint format (checkpoint_format, which imports torch), the metrics row (row), a run's summary
(summary) and Hugging Face model folders (hf_folder)."""
