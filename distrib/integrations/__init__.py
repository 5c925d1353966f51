"""Bridges to the engines that start workers themselves (Ray Train); each imports its engine only when called."""
