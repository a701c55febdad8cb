"""Tasks of one city's own: a worked example of QuorumFL's task plug-in API."""
