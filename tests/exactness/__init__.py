"""The differential harness: random configurations trained under this project and under
plain TorchRec, compared step by step (``make exactness``; see ``__main__``)."""
