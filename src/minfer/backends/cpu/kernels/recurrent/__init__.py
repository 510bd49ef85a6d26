"""Ops that carry a per-sequence recurrent state between forwards.

    shortconv   LFM2's gated short convolution over the last taps - 1 inputs (its state)
"""
