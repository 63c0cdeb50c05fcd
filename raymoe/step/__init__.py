"""Records of one step that the scheduler (driver side) and the runner (rank side) both use.

This package sits below both: it imports neither ``raymoe.scheduler`` nor ``raymoe.runner``, and they import it.

Ownership of the types:

* :class:`~raymoe.step.forward_mode.ForwardMode`: chosen by the scheduler and the driver, read by everyone.
* :class:`~raymoe.step.worker_batch.ModelWorkerBatch`: built by the scheduler (``ScheduleBatch``) or the driver
  (IDLE batches), plain data that crosses the driver -> rank actor boundary; read by the rank's ``ModelRunner``.
* :class:`~raymoe.step.sampling_inputs.SamplingInputs`: the per-row sampling numbers inside a
  ``ModelWorkerBatch``; the rank turns it into tensors (``SamplingBatchInfo``).
* :class:`~raymoe.step.step_output.StepOutput` / :class:`~raymoe.step.step_output.TokenLogprobs`: the rank's
  answer; the scheduler applies it to its requests and the front ends stream the log-probs.
"""
