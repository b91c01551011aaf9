//! Streaming generators (`num_returns="streaming"`): the items a running task reports
//! to its owner, and the consumer's blocking reads of them.

use super::*;

pub(super) struct GenState {
    pub(super) items: Vec<String>,
    pub(super) finished: bool,
    pub(super) error: Option<pb::TaskError>,
}

/// Blocks for the next item of a streaming task (see [`crate::ObjectRefGenerator`]).
pub(crate) fn next_generator_item(
    task_id: &str,
    function: &str,
    index: u64,
) -> Option<Result<RawRef, Error>> {
    let c = try_core()?;
    c.rt.block_on(c.next_item(task_id, function, index))
}

/// Blocks for the next item of a streaming task as a ref, a failure included (see
/// [`Core::next_item_ref`]).
pub(crate) fn next_generator_item_ref(task_id: &str, function: &str, index: u64) -> Option<RawRef> {
    let c = try_core()?;
    c.rt.block_on(c.next_item_ref(task_id, function, index))
}

/// Forgets a streaming task's bookkeeping once its consumer is gone.
pub(crate) fn drop_generator(task_id: &str, consumed: u64) {
    if let Some(c) = try_core() {
        let g = c.generators.lock().unwrap().remove(task_id);
        if let Some(g) = g {
            // Items never taken still carry the generator's hold.
            for id in g.items.into_iter().skip(consumed as usize) {
                release_ref(&id, &c.address.clone());
            }
        }
    }
}

impl Core {
    /// Owner side of `ReportGeneratorItem`.
    pub(crate) fn generator_item(&self, task_id: &str, index: u64, item: pb::ReturnObject) {
        let mut gens = self.generators.lock().unwrap();
        let Some(g) = gens.get_mut(task_id) else { return };
        if (index as usize) < g.items.len() {
            return; // a retried task re-reporting an item we have
        }
        let state = ObjState::from_return(item.clone());
        // Held by the generator until the consumer takes its ref.
        self.objects.lock().unwrap().register(
            item.object_id.clone(),
            Owned {
                state,
                lineage: None,
                pulls: None,
                task_id: None,
                nested: vec![],
                pins: vec![],
            },
        );
        g.items.push(item.object_id);
        drop(gens);
        self.objects_changed.notify_waiters();
    }

    pub(crate) fn streaming_item_id(task_id: &str, index: u64) -> String {
        return_id(task_id, index)
    }

    pub(super) async fn next_item(
        &self,
        task_id: &str,
        function: &str,
        index: u64,
    ) -> Option<Result<RawRef, Error>> {
        loop {
            let notified = self.objects_changed.notified();
            {
                let gens = self.generators.lock().unwrap();
                let g = gens.get(task_id)?;
                if let Some(id) = g.items.get(index as usize) {
                    // The generator's hold becomes the consumer's ref.
                    return Some(Ok(RawRef::adopt(id.clone(), self.address.clone())));
                }
                if g.finished {
                    return g.error.as_ref().map(|e| Err(Error::from_wire(e, function)));
                }
            }
            notified.await;
        }
    }

    /// As [`Core::next_item`], but a failure comes as a ref (Ray 2.60's streaming
    /// generators): the item after the last one produced is a ref whose `get` fails with
    /// the task's error, and the one after that is `None`.
    pub(super) async fn next_item_ref(
        &self,
        task_id: &str,
        function: &str,
        index: u64,
    ) -> Option<RawRef> {
        match self.next_item(task_id, function, index).await? {
            Ok(r) => Some(r),
            Err(_) => {
                let e = {
                    let gens = self.generators.lock().unwrap();
                    let g = gens.get(task_id)?;
                    if index as usize != g.items.len() {
                        return None; // the error was handed out already
                    }
                    g.error.clone()?
                };
                let id = Self::streaming_item_id(task_id, index);
                self.register_owned(&id, ObjState::failed(e), None);
                Some(RawRef::adopt(id, self.address.clone()))
            }
        }
    }

    /// Whether the next item of streaming task `task_id` after `index` items is there,
    /// or the stream ended (what `wait` on a generator answers). Unknown tasks: true.
    pub(crate) fn generator_ready(&self, task_id: &str, index: u64) -> bool {
        let gens = self.generators.lock().unwrap();
        gens.get(task_id).is_none_or(|g| g.items.len() as u64 > index || g.finished)
    }
}
