"""Discrete-event simulator of the proxy's non-preemptive queue, in virtual time.

It drives the proxy's own queues and policies (``clairvoyant.scheduling.policy.build_queue`` over
``clairvoyant.scheduling.job_queue``): no second SJF lives here. It never imports the dispatcher, the app or
any HTTP library. Modules:

    workload     arrivals (Poisson, burst) and service-time models (normal, lognormal, replay, prompts)
    workload     also the two-tenant flood (``two_tenant_workload``), two models (``with_models``) and
                 queue deadlines (``with_deadlines``)
    predictors   scorers: oracle, noisy at a target ranking accuracy, label (right a fraction of the
                 time), a real predictor over prompts; each gives score, predicted seconds, bucket
    engine       the event loop: ``simulate(workload, beliefs, policy=, starvation_timeout_s=, slots=, ...)``;
                 with models, slots that hold one model and pay ``switch_s`` to load another
    report       per-class percentiles, mean +/- std over seeds, JSON/CSV/markdown
    plots        PNG plots (matplotlib, Agg)
    experiments  conditions x seeds, and the paper's tau sweep and utilisation spectrum
    compare      every policy on the paper, heavy-tailed and two-tenant workloads; fcfs, the paper's
                 rule, the default without and with model affinity on the two-model and deadline workloads
    swaps        model switches on mixed bursts and Poisson arrivals (2 and 3 models): fcfs, the switch
                 rule before weighing, the default, and the best order of small cases (every order tried)
    command      ``clairvoyant simulate run | tau-sweep | spectrum | compare | swaps``
"""

from __future__ import annotations

from clairvoyant.tools.sim.engine import Schedule, simulate
from clairvoyant.tools.sim.experiments import Condition, Setup, paper_service, run_conditions, spectrum, tau_sweep
from clairvoyant.tools.sim.predictors import NoisyScorer, OracleScorer, PredictorScorer, pairwise_accuracy
from clairvoyant.tools.sim.workload import (
    LognormalService,
    NormalService,
    PromptService,
    ReplayService,
    Workload,
    make_workload,
)

__all__ = [
    "Condition",
    "LognormalService",
    "NoisyScorer",
    "NormalService",
    "OracleScorer",
    "PredictorScorer",
    "PromptService",
    "ReplayService",
    "Schedule",
    "Setup",
    "Workload",
    "make_workload",
    "pairwise_accuracy",
    "paper_service",
    "run_conditions",
    "simulate",
    "spectrum",
    "tau_sweep",
]
