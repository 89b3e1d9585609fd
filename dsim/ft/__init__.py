"""Fault tolerance on MPI's ULFM: agree on what survives a failure, and save or repair from replicas.

ulfm:      is ULFM there; revoke, shrink, and which ranks failed
wrapper:   OptTFTWrapper, the optimizer wrapper that records each update's phase and keeps the state before it
last_gasp: survivors agree on a step every slice still has, and write it as a committed checkpoint (TTP)
"""
from .wrapper import OptTFTWrapper

__all__ = ["OptTFTWrapper"]
