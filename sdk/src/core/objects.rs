//! Putting and getting objects: `put` into this process's table or the node's store,
//! waiting for an owned object, asking a borrowed one's owner, and pulling copies from
//! other nodes (OBJ-8: the owner assigns each pull a source).

use super::*;

/// Pulls one process runs at once. Each has at most the agent's channel of
/// chunks plus the one being written in flight (about 20 MiB), so a process
/// holds at most about 80 MiB of object bytes in transit.
pub(super) const MAX_PULLS_PER_PROCESS: usize = 4;

/// OBJ-8: the sources a puller on node `puller` copies stored object `o` from
/// ([`transfer::Pulls::assign`]); `None` while it is not stored or must wait.
pub(super) fn assign_source(o: &mut Owned, puller: &str) -> Option<Vec<pb::ObjectLocation>> {
    let Owned { state, pulls, .. } = o;
    let ObjState::Stored { locations, .. } = state else { return None };
    transfer::Pulls::assign(pulls, locations, puller, Instant::now())
}

/// Why a pull failed: the source (its node is gone, or it no longer has the
/// object: that copy is lost) or this node (its store cannot take the copy).
pub(super) enum PullError {
    Source(String),
    Local(String),
}

impl Core {
    /// Stores `bytes` as a new owned object (`put`).
    /// `nested`: refs serialized inside `bytes`, kept alive as long as this
    /// object lives (CORE-2).
    pub(crate) fn put_bytes(&self, bytes: Vec<u8>, nested: Vec<RawRef>) -> Result<RawRef, Error> {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        let state = self.make_state(&id, bytes)?;
        self.register_owned(&id, state, None);
        if !nested.is_empty()
            && let Some(o) = self.objects.lock().unwrap().get_mut(&id)
        {
            o.pins = nested;
        }
        Ok(RawRef::adopt(id, self.address.clone()))
    }

    /// Stores the concatenation of `parts` as a new owned object (`put` of a
    /// value serialized in pieces: a pickle and the buffers it refers to). A
    /// large one is written part by part straight into this node's store,
    /// never joined in memory first. `nested` as for [`Core::put_bytes`].
    pub(crate) fn put_parts(&self, parts: &[&[u8]], nested: Vec<RawRef>) -> Result<RawRef, Error> {
        let size = parts.iter().map(|p| p.len()).sum::<usize>();
        if size <= INLINE_MAX_BYTES {
            return self.put_bytes(parts.concat(), nested);
        }
        self.put_streamed(size, |write| {
            for p in parts {
                write(p)?;
            }
            Ok(nested)
        })
    }

    /// Stores a new owned object of `size` bytes that `write` hands over piece by piece
    /// (`put` of a large value: its encoding goes straight into this node's store, never
    /// into a buffer of its own first). `write` returns the refs nested in the value.
    ///
    /// # Errors
    /// The store cannot take `size` bytes (OBJ-7), a write fails, or `write` handed over
    /// another number of bytes than `size`.
    pub(crate) fn put_streamed(
        &self,
        size: usize,
        write: impl FnOnce(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<Vec<RawRef>>,
    ) -> Result<RawRef, Error> {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        let size = size as u64;
        let opts = CreateOptions {
            size: Some(size),
            owner: Some(self.address.clone()),
            ..Default::default()
        };
        let cluster = |e: tpuray_objectstore::StoreError| Error::Cluster(e.to_string());
        // OBJ-7: a store that cannot take it fails at once, naming the sizes.
        let mut w = self.store.create_with(&id, &opts).map_err(cluster)?;
        let nested =
            write(&mut |piece| w.write(piece)).map_err(|e| Error::Cluster(e.to_string()))?;
        // A size that differs is refused here (the writer is dropped, its file removed).
        w.seal(Some(size)).map_err(cluster)?;
        let state = ObjState::Stored { locations: vec![self.location()], size };
        self.register_owned(&id, state, None);
        if !nested.is_empty()
            && let Some(o) = self.objects.lock().unwrap().get_mut(&id)
        {
            o.pins = nested;
        }
        Ok(RawRef::adopt(id, self.address.clone()))
    }

    /// Inline when small, else written to this node's store.
    pub(super) fn make_state(&self, id: &str, bytes: Vec<u8>) -> Result<ObjState, Error> {
        if bytes.len() <= INLINE_MAX_BYTES {
            Ok(ObjState::Inline(Arc::new(bytes)))
        } else {
            let size = bytes.len() as u64;
            let opts = CreateOptions { owner: Some(self.address.clone()), ..Default::default() };
            // OBJ-7: a store that cannot take it fails at once, naming the sizes.
            self.store.put_with(id, &bytes, &opts).map_err(|e| Error::Cluster(e.to_string()))?;
            Ok(ObjState::Stored { locations: vec![self.location()], size })
        }
    }

    /// Waits until `r` is ready; its bytes. Copies that cannot be read are
    /// reported lost (to this process's table, or to the owner), which makes
    /// the object again from lineage or fails it (CORE-6).
    pub(crate) async fn get_data(
        self: &Arc<Self>,
        r: &RawRef,
        deadline: Option<Instant>,
    ) -> Result<Data, Error> {
        let id = r.id();
        let mut lost: Vec<String> = Vec::new();
        loop {
            let locations = if r.owner() == self.address {
                if !lost.is_empty() {
                    self.object_lost(id, &std::mem::take(&mut lost));
                }
                match self.wait_owned(id, &self.node_id, deadline).await? {
                    Ready::Inline(b) => return Ok(Data::Inline(b)),
                    Ready::Stored(locations) => locations,
                }
            } else {
                match self.ask_owner(r, deadline, std::mem::take(&mut lost)).await? {
                    Ready::Inline(b) => return Ok(Data::Inline(b)),
                    Ready::Stored(locations) => locations,
                }
            };
            match self.fetch(id, r.owner(), &locations).await {
                Ok(d) => return Ok(d),
                Err((e, failed)) if failed.is_empty() => return Err(e),
                Err((_, failed)) => lost = failed,
            }
        }
    }

    /// Waits until owned object `id` is ready (inline bytes or locations);
    /// `puller` as in [`Core::wait_ready`].
    pub(super) async fn wait_owned(
        &self,
        id: &str,
        puller: &str,
        deadline: Option<Instant>,
    ) -> Result<Ready, Error> {
        match self.wait_ready(id, puller, deadline).await {
            Got::Ready(r, _) => Ok(r),
            Got::Failed(e) => Err(Error::from_wire(&e, id)),
            Got::Unknown => {
                Err(Error::ObjectLost { id: id.into(), message: "freed by its owner".into() })
            }
            Got::TimedOut => Err(Error::Timeout(Duration::ZERO, 1)),
        }
    }

    /// Waits until owned object `id` is ready or failed. For a stored object
    /// and a `puller` node ("" for none), waits also until a copy can serve
    /// it and answers with that one source ([`assign_source`], OBJ-8).
    pub(super) async fn wait_ready(
        &self,
        id: &str,
        puller: &str,
        deadline: Option<Instant>,
    ) -> Got {
        loop {
            let notified = self.objects_changed.notified();
            {
                let mut objs = self.objects.lock().unwrap();
                let Some(o) = objs.get_mut(id) else { return Got::Unknown };
                match &o.state {
                    ObjState::Pending => {}
                    ObjState::Inline(b) => {
                        return Got::Ready(Ready::Inline(Arc::clone(b)), b.len() as u64);
                    }
                    ObjState::Failed(e) => return Got::Failed((**e).clone()),
                    ObjState::Stored { locations, size } => {
                        let size = *size;
                        if puller.is_empty() {
                            return Got::Ready(Ready::Stored(locations.clone()), size);
                        }
                        if let Some(l) = assign_source(o, puller) {
                            return Got::Ready(Ready::Stored(l), size);
                        }
                    }
                }
            }
            crate::direct::kick();
            match deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d.into(), notified).await.is_err() {
                        return Got::TimedOut;
                    }
                }
                None => notified.await,
            }
        }
    }

    /// A pull the owner assigned ended (owner side of `ReportObjectCopy`):
    /// frees its source and, when it succeeded, adds the puller's copy as a
    /// source for later pullers (OBJ-8).
    pub(crate) fn copy_done(
        &self,
        id: &str,
        source: &str,
        puller: &str,
        copy: Option<pb::ObjectLocation>,
    ) {
        let orphan = {
            let mut objs = self.objects.lock().unwrap();
            match objs.get_mut(id) {
                Some(o) => {
                    if let Some(p) = o.pulls.as_mut() {
                        p.done(source, puller);
                    }
                    // CORE-10: a node the head declared dead holds no copy any more.
                    if let (Some(c), ObjState::Stored { locations, .. }) = (copy, &mut o.state)
                        && !locations.iter().any(|l| l.node_id == c.node_id)
                        && !self.deaths.is_dead(&c.node_id)
                    {
                        locations.push(c);
                    }
                    None
                }
                // Freed while it was pulled: that copy goes too (CORE-2).
                None => copy,
            }
        };
        if let Some(c) = orphan {
            self.free_copies(id.to_string(), vec![c]);
        }
        self.objects_changed.notify_waiters();
    }

    /// Tells `owner` that this node's pull of `id` from `source` ended.
    pub(super) async fn report_copy(
        &self,
        id: &str,
        owner: &str,
        source: &str,
        copy: Option<pb::ObjectLocation>,
    ) {
        if owner == self.address {
            self.copy_done(id, source, &self.node_id, copy);
            return;
        }
        let Ok(mut c) = self.worker_client(owner) else { return };
        let mut req = Request::new(pb::ReportObjectCopyRequest {
            object_id: id.to_string(),
            source_node_id: source.to_string(),
            puller_node_id: self.node_id.clone(),
            copy,
        });
        req.set_timeout(Duration::from_secs(10));
        let _ = c.report_object_copy(req).await;
    }

    /// A borrower asks the owner for the object (long poll), first reporting
    /// the nodes whose copies it could not read.
    pub(super) async fn ask_owner(
        &self,
        r: &RawRef,
        deadline: Option<Instant>,
        mut lost: Vec<String>,
    ) -> Result<Ready, Error> {
        let mut client =
            self.worker_client(r.owner()).map_err(|e| Error::Cluster(e.to_string()))?;
        let mut asked_again = false;
        loop {
            let wait = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(Duration::from_secs(10)),
                None => Duration::from_secs(10),
            };
            let mut req = Request::new(pb::GetObjectRequest {
                object_id: r.id().to_string(),
                timeout_ms: wait.as_millis() as u64,
                lost_node_ids: std::mem::take(&mut lost),
                puller_node_id: self.node_id.clone(),
            });
            req.set_timeout(wait + Duration::from_secs(10));
            let reply = client.get_object(req).await;
            // A connection lost under the call (the owner may have died just then) is
            // asked once more: a dead owner then refuses the connection.
            if let Err(s) = &reply
                && s.code() == tonic::Code::Unknown
                && !asked_again
            {
                asked_again = true;
                continue;
            }
            let reply = reply.map_err(|s| Error::ObjectLost {
                id: r.id().to_string(),
                message: if s.code() == tonic::Code::Unavailable {
                    format!(
                        "{OWNER_DIED}: its owner at {} cannot be reached: {}",
                        r.owner(),
                        s.message()
                    )
                } else {
                    format!("its owner at {} did not answer: {}", r.owner(), s.message())
                },
            })?;
            let reply = reply.into_inner();
            match pb::get_object_reply::Status::try_from(reply.status) {
                Ok(pb::get_object_reply::Status::Ready) => {
                    return Ok(if reply.locations.is_empty() {
                        Ready::Inline(Arc::new(reply.inline_value))
                    } else {
                        Ready::Stored(reply.locations)
                    });
                }
                Ok(pb::get_object_reply::Status::Failed) => {
                    return Err(Error::from_wire(&reply.error.unwrap_or_default(), r.id()));
                }
                Ok(pb::get_object_reply::Status::Unknown) => {
                    return Err(Error::ObjectLost {
                        id: r.id().to_string(),
                        message: "its owner no longer has it".into(),
                    });
                }
                _ => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(Error::Timeout(Duration::ZERO, 1));
                    }
                }
            }
        }
    }

    /// Maps the local copy, or pulls one from another node into this node's
    /// store first (a secondary copy, evictable, recording `owner`). On
    /// failure also the nodes whose copies could not be read (this node's
    /// own when its listed copy is gone): the caller reports them lost.
    pub(super) async fn fetch(
        &self,
        id: &str,
        owner: &str,
        locations: &[pb::ObjectLocation],
    ) -> Result<Data, (Error, Vec<String>)> {
        let local_dir = self.store.dir().display().to_string();
        let mut failed = Vec::new();
        match self.map_local(id).await {
            Ok(Some(v)) => {
                if let Some(src) = locations
                    .first()
                    .filter(|_| !locations.iter().any(|l| l.store_dir == local_dir))
                {
                    // A copy here the owner did not know of: it frees the source
                    // it assigned and hands this one out from now on.
                    self.report_copy(id, owner, &src.node_id, Some(self.location())).await;
                }
                return Ok(Data::Mapped(Arc::new(v)));
            }
            Ok(None) => failed.extend(
                locations.iter().filter(|l| l.store_dir == local_dir).map(|l| l.node_id.clone()),
            ),
            Err(_) => {}
        }
        let mut last = String::from("no copy is known");
        for loc in locations.iter().filter(|l| l.store_dir != local_dir) {
            let pulled = self.pull(id, owner, loc).await;
            // The owner frees the source it assigned; a lost source is
            // reported with the next request instead (CORE-6).
            match &pulled {
                Ok(()) => self.report_copy(id, owner, &loc.node_id, Some(self.location())).await,
                Err(PullError::Local(_)) => self.report_copy(id, owner, &loc.node_id, None).await,
                Err(PullError::Source(_)) => {}
            }
            match pulled {
                Ok(()) => match self.map_local(id).await {
                    Ok(Some(v)) => return Ok(Data::Mapped(Arc::new(v))),
                    Ok(None) => last = "the pulled copy was evicted before it was read".into(),
                    Err(e) => last = e,
                },
                Err(PullError::Source(e)) => {
                    failed.push(loc.node_id.clone());
                    last = e;
                }
                Err(PullError::Local(e)) => last = e,
            }
        }
        Err((
            Error::ObjectLost {
                id: id.to_string(),
                message: format!("no node could provide it: {last}"),
            },
            failed,
        ))
    }

    /// Maps this node's copy of `id`. Off the runtime threads: a spilled
    /// object may be restored first (megabytes of copying).
    pub(super) async fn map_local(&self, id: &str) -> Result<Option<ObjectView>, String> {
        let store = self.store.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || store.get(&id).map_err(|e| e.to_string()))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Pulls `id` from the agent of `loc` into this node's store as a
    /// secondary copy; ends with a source error once the head declares that node
    /// dead (CORE-10). Store calls (reserving room may spill or evict) run
    /// off the runtime threads, one chunk at a time.
    pub(super) async fn pull(
        &self,
        id: &str,
        owner: &str,
        loc: &pb::ObjectLocation,
    ) -> Result<(), PullError> {
        let agent = &loc.agent_address;
        let source = |m: String| PullError::Source(format!("{agent}: {m}"));
        if self.deaths.is_dead(&loc.node_id) {
            return Err(source(node_died(&loc.node_id).message().to_string()));
        }
        if let Some(core) = try_core() {
            core.watch_nodes();
        }
        let _permit =
            self.pull_permits.acquire().await.map_err(|e| PullError::Local(e.to_string()))?;
        let mut c = self.objects_client(agent).map_err(|e| source(e.to_string()))?;
        let request = c.pull(pb::PullRequest { object_id: id.to_string(), chunk_size: 0 });
        let mut stream = self
            .unless_node_dies(&loc.node_id, request)
            .await
            .map_err(|s| source(s.message().to_string()))?
            .into_inner();
        let mut w: Option<Writer> = None;
        let mut total = None;
        while let Some(chunk) = self
            .unless_node_dies(&loc.node_id, stream.message())
            .await
            .map_err(|s| source(s.message().to_string()))?
        {
            total = Some(chunk.total_size);
            let writer = w.take();
            let store = self.store.clone();
            let (id, owner) = (id.to_string(), owner.to_string());
            let size = chunk.total_size;
            w = Some(
                tokio::task::spawn_blocking(move || {
                    let mut w = match writer {
                        Some(w) => w,
                        None => {
                            let opts = CreateOptions {
                                size: Some(size),
                                copy: CopyKind::Secondary,
                                owner: (!owner.is_empty()).then_some(owner),
                            };
                            store.create_with(&id, &opts).map_err(|e| e.to_string())?
                        }
                    };
                    w.write(&chunk.data).map_err(|e| e.to_string())?;
                    Ok::<_, String>(w)
                })
                .await
                .map_err(|e| PullError::Local(e.to_string()))?
                .map_err(PullError::Local)?,
            );
        }
        let Some(w) = w else {
            return Err(source(format!("the pull of {id} ended without data")));
        };
        tokio::task::spawn_blocking(move || w.seal(total).map_err(|e| e.to_string()))
            .await
            .map_err(|e| PullError::Local(e.to_string()))?
            .map_err(PullError::Local)
    }

    /// Whether `r` is ready now (for `wait`).
    pub(crate) async fn is_ready(&self, r: &RawRef) -> bool {
        if r.owner() == self.address {
            !matches!(
                self.objects.lock().unwrap().get(r.id()).map(|o| &o.state),
                Some(ObjState::Pending)
            )
        } else {
            let Ok(mut c) = self.worker_client(r.owner()) else {
                return true;
            };
            match c
                .get_object(pb::GetObjectRequest {
                    object_id: r.id().to_string(),
                    ..Default::default()
                })
                .await
            {
                Ok(rep) => rep.into_inner().status != pb::get_object_reply::Status::Pending as i32,
                Err(_) => true,
            }
        }
    }

    /// Resolves when any owned object changes state. Create it before checking states,
    /// so a change between the check and the wait is not missed.
    /// Replies sent to direct connections that no one reads yet are read now
    /// ([`crate::direct::kick`]).
    pub(crate) fn objects_changed(&self) -> tokio::sync::futures::Notified<'_> {
        crate::direct::kick();
        self.objects_changed.notified()
    }

    /// Blocks this thread (one outside the runtime) until none of `refs` that this
    /// process owns is pending any more, or until `deadline`.
    ///
    /// It parks the thread instead of setting a runtime timer: a timer set from outside
    /// the runtime wakes the runtime's driver thread, one more thread wake for every
    /// `get` that waits in slices (the Python SDK's do, to see Ctrl-C).
    ///
    /// When the last call this thread sent went on a direct connection and one of `refs`
    /// is its return, the thread reads that connection's replies itself meanwhile
    /// ([`crate::direct::read_own_replies`]): no reader thread hands it the reply.
    pub(crate) fn settle_owned(&self, refs: &[RawRef], deadline: Instant) {
        let pending = || {
            let objs = self.objects.lock().unwrap();
            refs.iter()
                .any(|r| objs.get(r.id()).is_some_and(|o| matches!(o.state, ObjState::Pending)))
        };
        let ids: Vec<&str> = refs.iter().map(RawRef::id).collect();
        let settled = || !pending();
        block_on_until(
            async {
                loop {
                    let changed = self.objects_changed.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    if !pending() || Instant::now() >= deadline {
                        return;
                    }
                    if crate::direct::read_own_replies(&ids, &settled, deadline) {
                        continue;
                    }
                    crate::direct::kick();
                    changed.await;
                }
            },
            deadline,
        );
    }

    /// Owner side of `GetObject`; `lost`: nodes whose copies the caller
    /// could not read (CORE-6); `puller`: the caller's node when it will pull
    /// (answered with one assigned source, OBJ-8).
    pub(crate) async fn serve_get_object(
        self: &Arc<Self>,
        id: &str,
        timeout: Duration,
        lost: &[String],
        puller: &str,
    ) -> pb::GetObjectReply {
        use pb::get_object_reply::Status;
        if !lost.is_empty() {
            self.object_lost(id, lost);
        }
        let deadline = Instant::now() + timeout;
        match self.wait_ready(id, puller, Some(deadline)).await {
            Got::Ready(Ready::Inline(b), size) => pb::GetObjectReply {
                status: Status::Ready as i32,
                size,
                inline_value: b.to_vec(),
                ..Default::default()
            },
            Got::Ready(Ready::Stored(locations), size) => pb::GetObjectReply {
                status: Status::Ready as i32,
                locations,
                size,
                ..Default::default()
            },
            Got::Failed(e) => pb::GetObjectReply {
                status: Status::Failed as i32,
                error: Some(e),
                ..Default::default()
            },
            Got::Unknown => {
                pb::GetObjectReply { status: Status::Unknown as i32, ..Default::default() }
            }
            Got::TimedOut => {
                pb::GetObjectReply { status: Status::Pending as i32, ..Default::default() }
            }
        }
    }
}
