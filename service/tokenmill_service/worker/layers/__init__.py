"""Model building blocks that own their parameters and know how checkpoint tensors land in them."""
