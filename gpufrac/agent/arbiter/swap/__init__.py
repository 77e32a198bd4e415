"""The swap resolver: an idle container's GPU memory moved to host RAM, and back.

resolver    SwapResolver: who is swapped out, and the swap-in when it calls again
choice      which candidate is swapped
files       the swap state files that survive an agent restart
takeover    swapped containers taken over after an agent restart
checkpoint  the driver's checkpoint API (cuCheckpointProcess*), in worker threads
"""
