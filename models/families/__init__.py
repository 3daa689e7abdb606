"""The model families as pure JAX functions, one module per family, one interface.

    families.py   `module_for(cfg)`: the module that runs a config, and the
                  interface every family module exposes
    llama.py      the Llama family (SmolLM2, Llama 2/3, Mistral, Mixtral,
                  Qwen2/3, Phi-3)
    gemma3.py     Gemma 2 and Gemma 3 (`llama.py`'s interface)
    moe.py        the sparse mixture-of-experts FFN (Mixtral, Qwen3-MoE)
    common.py     what the families share: RMSNorm, RoPE, the attention pieces
                  (`partial_attention`, `merge_attention`, `causal_attend`),
                  the layer loop and the two parameter layouts
    flash.py      blockwise causal attention for long prefills
"""
