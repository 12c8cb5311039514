"""Test kit shipped with rl_ckpt, kept apart from the product: nothing in the engine imports it."""
