"""Reading a checkpoint: its formats, each family's mapping, its tokenizer, and the model names.

    registry.py        the one model-name table (embedded models, aliases,
                       published shapes): a name -> a file, before any read
    gguf_loader.py     a GGUF file -> (config, params, tokenizer)
    hf_loader.py       a Hugging Face directory (config.json, safetensors,
                       tokenizer.json) -> (config, params, tokenizer)
    architectures.py   `ARCHITECTURES`: the one list both formats dispatch on
    loader_core.py     `ConfigReader` (validated metadata), the tensor-copy
                       loop over a family's `TensorTable`, GGUF reading
    checks.py          the type and range rules of a metadata value
    llama_config.py    GGUF metadata or config.json -> `LlamaConfig`
    llama_loader.py    the Llama family's `Architecture`s (tensor tables)
    gemma3_loader.py   Gemma 2 and 3: config rules and tensor tables
    tokenizer.py       the checkpoint's tokenizer (`CheckpointTokenizer`) and
                       `ByteTokenizer`
    chat_template.py   a checkpoint's chat template, rendered as untrusted code
"""
