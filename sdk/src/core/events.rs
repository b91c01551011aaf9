//! Task events: buffered here and sent to the head in lossy batches (never on the
//! task's own path).

use super::*;

impl Core {
    pub(crate) fn event(&self, spec: &pb::TaskSpec, state: &str, error: &str) {
        self.event_at(spec, state, error, &self.node_id, &self.worker_id);
    }

    /// Where a task's output lies in this worker's log files (LOGS-3): an event
    /// that changes no state.
    pub(crate) fn log_event(&self, spec: &pb::TaskSpec, info: pb::TaskLogInfo) {
        let mut ev = self.events.lock().unwrap();
        if ev.len() < 100_000 {
            ev.push(pb::TaskEvent {
                task_id: spec.task_id.clone(),
                job_id: spec.job_id.clone(),
                name: spec.name.clone(),
                node_id: self.node_id.clone(),
                worker_id: self.worker_id.clone(),
                attempt: spec.attempt,
                time_ms: now_ms(),
                actor_id: spec.actor_id.clone(),
                log_info: Some(info),
                ..Default::default()
            });
        }
    }

    /// A task event naming where the task ran ("" when unknown).
    pub(super) fn event_at(
        &self,
        spec: &pb::TaskSpec,
        state: &str,
        error: &str,
        node: &str,
        worker: &str,
    ) {
        let mut ev = self.events.lock().unwrap();
        if ev.len() < 100_000 {
            ev.push(pb::TaskEvent {
                task_id: spec.task_id.clone(),
                job_id: spec.job_id.clone(),
                name: spec.name.clone(),
                state: state.to_string(),
                node_id: node.to_string(),
                worker_id: worker.to_string(),
                attempt: spec.attempt,
                error: error.to_string(),
                time_ms: now_ms(),
                actor_id: spec.actor_id.clone(),
                log_info: None,
            });
        }
    }

    /// Sends buffered task events to the head (lossy, batched).
    pub(crate) async fn flush_events(&self) {
        let _sending = self.events_sending.lock().await;
        let batch = std::mem::take(&mut *self.events.lock().unwrap());
        if batch.is_empty() {
            return;
        }
        if let Ok(mut head) = self.head_client() {
            let mut req = Request::new(pb::ReportTaskEventsRequest { events: batch });
            req.set_timeout(Duration::from_secs(5));
            let _ = head.report_task_events(req).await;
        }
    }
}
