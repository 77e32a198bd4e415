"""The watchdog: processes over their container's limit on the driver's count.

service  plan (which process is killed) and Watchdog (the periodic scan; kills in enforce
         mode, reports in report mode)
"""
