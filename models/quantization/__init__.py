"""Int8 weights: the quantised format, the products that read it, and its calibration.

    quant.py      `QuantizedWeight`, `quantize_params` and the products that
                  read it (W8A8 and weight-only)
    outliers.py   the input channels of each projection kept in float,
                  calibrated on a built-in text
"""
