"""Every byte on disk or in a bucket: file names (files), local/s3:// / gs:// storage and staged
folders (storage), finding runs and checkpoints (runs), the checkpoint format (checkpoint_format,
which imports torch)."""
