"""The Llama family: the decoder (llama.py) and its Hugging Face names (hf_llama.py)."""
