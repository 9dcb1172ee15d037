"""The SLO planner: sizes the prefill and decode tiers from TTFT/ITL targets while serving.

    replicas  costs.py     each engine's step times, fitted online (record_autoscaling_stats)
              load.py      each replica's arrivals, lengths and observed TTFT/ITL
    controller forecast.py the load of the next interval, from the replicas' reports
              sizing.py    predicted TTFT/ITL of a split; the split that meets both SLOs
              policy.py    Serve's application-level autoscaling policy: the loop above
"""
