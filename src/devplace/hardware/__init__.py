"""Devices, clusters and their presets (and, later, cost models). Imports only `graph/` and errors."""

from devplace.hardware.cluster import Cluster, Device, Link, load_cluster, save_cluster

__all__ = ["Cluster", "Device", "Link", "load_cluster", "save_cluster"]
