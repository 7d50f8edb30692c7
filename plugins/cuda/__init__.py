"""The cuda plugin: NVIDIA GPUs through torch.cuda, NCCL, CUDA graphs, cudaHostRegister, Triton ops."""

from polyaccel.version import API_VERSION

POLYACCEL_API_VERSION = API_VERSION
