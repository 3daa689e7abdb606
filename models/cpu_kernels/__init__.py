"""The int8 decode's CPU kernels: C++ XLA FFI custom calls, built on first use.

    cpu_kernels.py     builds the sources below into one library (under the
                       cache directory's `kernels/`), checks it against numpy,
                       registers it, and calls it (`int8_dot`, `w8a8_dot`,
                       `f32_int8_dot`, `segment_attention`), with XLA's
                       `dot_general` wherever the kernels are off
    cpu_kernels.cc     the int8 x int8 and float32 x int8 products
    cpu_w8a8.cc        W8A8's whole product in one call
    cpu_attention.cc   the attention over one segment of keys
    cpu_kernels.h      what the sources share

The C++ files ship in the wheel beside `cpu_kernels.py`, which finds them
relative to its own file.
"""
