"""Text and tokens: the tokenizer (Hugging Face tokenizers) and chat templates."""
