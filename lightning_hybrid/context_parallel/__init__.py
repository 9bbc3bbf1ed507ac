"""Context parallelism: each sample's sequence split over the ranks of a ``cp`` group, every block run on its part,
attention on the whole sequence for a share of the heads (an all-to-all each way), for unmodified models."""
