"""Models: plain nn.Modules that know nothing of ranks or devices (the seed Network, the GPT), and building the
configured model from a built-in name or the user's factory."""

from distrib.models.build import batchnorm_layers, build_model, data_kwargs, factory_call
from distrib.models.gpt import GPT
from distrib.models.network import Network

__all__ = ["GPT", "Network", "batchnorm_layers", "build_model", "data_kwargs", "factory_call"]
