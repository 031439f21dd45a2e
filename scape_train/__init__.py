"""scape_train: end-to-end LLM pretraining with SCAPE and GASLoC."""

__version__ = "0.1.0"
