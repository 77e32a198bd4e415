"""Idle reaping of interactive pods (the judging, the acting, and what the Events say).

reaper   IdleReaper: which idle or overrunning pod is warned, spared or acted on
actions  IdleActions: notify, swap, evict or delete
view     the pod as judged, and the words of its Events
"""
