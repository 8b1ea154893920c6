"""Convolutions as implicit GEMMs on tensor cores."""
