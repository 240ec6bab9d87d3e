"""Faults a real run meets: a full disk or a file size limit mid-write, SIGINT/SIGTERM in a chosen phase of a real
process, concurrent runs on one cache, and a long soak (no growth in memory, descriptors or threads)."""
