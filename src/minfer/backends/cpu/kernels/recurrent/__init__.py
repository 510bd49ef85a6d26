"""Ops that carry a per-sequence recurrent state between forwards.

    shortconv   causal depthwise convolutions over the last taps - 1 inputs (their state):
                LFM2's gated short convolution, Qwen3.5's ssm_conv (then SiLU)
    delta_net   Qwen3.5's gated delta rule over a state matrix per value head
"""
