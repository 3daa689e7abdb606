"""Reference model families and their weight/tokenizer loaders."""
