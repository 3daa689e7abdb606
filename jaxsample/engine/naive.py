"""The naive engine: the test oracle and the benchmark baseline, not an API.

`naive_generate` runs the engine's own code on N materialised copies of each
prompt (N prefills, N prefix caches, one branch per row), which is what
Hugging Face's `generate(num_return_sequences=N)` does. Its tokens equal
`generate`'s up to float ties (the same keys: prompt b's copy n is branch n
of prompt b), so tests use it as the oracle of prefix sharing, and
benchmarks as the baseline sharing is measured against.
"""

from __future__ import annotations

from jaxsample.engine import api


def naive_generate(lm, prompts, params=None, *, chat: bool = False,
                   prompt_index_offset: int = 0, chunk_size: int | None = None,
                   progress=False):
    """`jaxsample.generate` on N copies of every prompt (one device, no Bridge, no
    shared context, no pool).

    Args:
      lm, prompts, params, chat, prompt_index_offset, chunk_size, progress: as
        `jaxsample.generate`.
    Returns:
      A `Generation` shaped as `generate`'s (`[B, N, T]`); its bill counts N
      prefills and N prefix copies.
    Raises:
      InputError: as `generate`.
    """
    return api.run_generate(lm, prompts, params, chat=chat, naive=True,
                            prompt_index_offset=prompt_index_offset, chunk_size=chunk_size,
                            progress=progress)
