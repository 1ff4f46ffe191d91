/* global Worker, MessageChannel, RTCPeerConnection */
// Page: the signalling over the forwarder's ws (JSON), the RTCPeerConnection in the page.
window.proto = (() => {
  let sig, pc, dc, worker, bridgeChan;

  const wmsg = (pred) => new Promise((r) => { const h = (e) => { if (pred(e.data)) { worker.removeEventListener('message', h); r(e.data); } }; worker.addEventListener('message', h); });
  async function init(id, wsUrl) {
    worker = new Worker('/worker.js');
    worker.addEventListener('message', (e) => { if (e.data.log) console.log('worker:', e.data.log); });
    sig = new WebSocket(`${wsUrl}?id=${id}-sig`);
    sig.onmessage = (e) => onSig(JSON.parse(e.data));
    await new Promise((r) => (sig.onopen = r));
    worker.postMessage({ cmd: 'caps' });
    const caps = (await wmsg((d) => d.caps)).caps;
    worker.postMessage({ cmd: 'ws', url: `${wsUrl}?id=${id}-data` });
    await wmsg((d) => d.ok === 'ws');
    return { page: { RTCPeerConnection: typeof RTCPeerConnection }, worker: caps };
  }
  let peerSig; let onOpenDc; let transferOnCreate = false; let transferResult;
  function tryTransfer(ch) {
    try { worker.postMessage({ cmd: 'dc', dc: ch }, [ch]); transferResult = 'transferred'; return true; }
    catch (e) { transferResult = `${e.name}: ${e.message}`; return false; }
  }
  function newPc() {
    pc = new RTCPeerConnection({ iceServers: [] });
    pc.onicecandidate = (e) => { if (e.candidate) sig.send(JSON.stringify({ to: peerSig, cand: e.candidate.toJSON() })); };
    pc.ondatachannel = (e) => { const ch = e.channel; if (transferOnCreate && tryTransfer(ch)) { onOpenDc?.(ch, true); return; } ch.binaryType = 'arraybuffer'; setupMain(ch); };
    return pc;
  }
  function setupMain(ch) {
    dc = ch;
    const fire = () => onOpenDc?.(ch, false);
    if (ch.readyState === 'open') fire(); else ch.onopen = fire;
  }
  async function onSig(m) {
    if (m.sdp) {
      if (!pc) newPc();
      await pc.setRemoteDescription(m.sdp);
      if (m.sdp.type === 'offer') { await pc.setLocalDescription(); sig.send(JSON.stringify({ to: peerSig, sdp: pc.localDescription })); }
    } else if (m.cand) await pc.addIceCandidate(m.cand);
  }
  async function connect(peer, offerer, transfer) {
    peerSig = `${peer}-sig`; transferOnCreate = transfer;
    const opened = new Promise((r) => (onOpenDc = (ch, moved) => r(moved)));
    const t0 = performance.now();
    if (offerer) {
      newPc();
      const ch = pc.createDataChannel('hop', { ordered: true });
      if (transfer && tryTransfer(ch)) onOpenDc?.(ch, true); else { ch.binaryType = 'arraybuffer'; setupMain(ch); }
      await pc.setLocalDescription();
      sig.send(JSON.stringify({ to: peerSig, sdp: pc.localDescription }));
    }
    const moved = await opened;
    let wstate;
    if (moved) wstate = await wmsg((d) => d.ok === 'dc');
    const stats = []; (await pc.getStats()).forEach((s) => { if (s.type === 'candidate-pair' && s.nominated) stats.push({ state: s.state, rtt: s.currentRoundTripTime }); if (s.type === 'local-candidate') stats.push({ local: s.address, t: s.candidateType, proto: s.protocol }); });
    return { openMs: performance.now() - t0, transferResult, moved, wstate, stats, maxMsg: pc.sctp?.maxMessageSize };
  }
  // The bridge: worker <-> MessagePort <-> page <-> dc.
  async function bridge() {
    bridgeChan = new MessageChannel();
    const mine = bridgeChan.port1;
    mine.onmessage = (e) => dc.send(e.data);
    dc.onmessage = (e) => mine.postMessage(e.data, [e.data]);
    worker.postMessage({ cmd: 'port', port: bridgeChan.port2 }, [bridgeChan.port2]);
    await wmsg((d) => d.ok === 'port');
  }
  // Main-thread-only echo/bench (the DC's own cost).
  let mainEcho = false; let mainWaiter;
  function mainOnly() { dc.onmessage = (e) => { if (mainEcho) dc.send(e.data); else { const w = mainWaiter; mainWaiter = undefined; w?.(); } }; }
  async function mainBench(bytes, n, gap) {
    const rtts = [];
    for (let i = 0; i < n; i++) {
      if (gap > 0) await new Promise((r) => setTimeout(r, gap));
      const p = new Promise((r) => (mainWaiter = r)); const t0 = performance.now(); dc.send(new Uint8Array(bytes)); await p; rtts.push(performance.now() - t0);
    }
    rtts.sort((a, b) => a - b);
    return { p50: rtts[rtts.length >> 1], p10: rtts[Math.floor(rtts.length * 0.1)], p90: rtts[Math.floor(rtts.length * 0.9)] };
  }
  async function workerCmd(m) { worker.postMessage(m); return wmsg((d) => d.ok === 'echo' || d.ok === 'spin' || d.result); }
  return { init, connect, bridge, mainOnly, setMainEcho: (v) => (mainEcho = v), mainBench, workerCmd };
})();
