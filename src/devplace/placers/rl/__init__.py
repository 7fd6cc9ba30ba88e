"""Learned placers (reinforcement learning): `placeto`."""
