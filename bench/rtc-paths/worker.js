/* global postMessage, MessageChannel */
// Worker: a ws to the forwarder, and a port from the page (bridge), maybe a transferred data channel.

let ws, port, dc;
const echo = { ws: false, port: false, dc: false };
const waiters = new Map();
function onData(kind, data) {
  if (echo[kind]) { send(kind, data); return; }
  const w = waiters.get(kind); if (w) { waiters.delete(kind); w(data); }
}
function send(kind, data) {
  if (kind === 'ws') ws.send(data);
  else if (kind === 'port') port.postMessage(data, [data]);
  else if (kind === 'dc') dc.send(data);
}
// --warm: the worker never sleeps (a MessageChannel posting to itself: a task after every task, messages and timers
// still run between them): is the cost of a message after an idle spell our thread's wake, or deeper?
let spinning = false;
const loop = new MessageChannel();
loop.port1.onmessage = () => { if (spinning) loop.port2.postMessage(0); };
function spin(on) {
  const was = spinning;
  spinning = on;
  if (on && !was) loop.port2.postMessage(0);
}
async function pingpong(kind, bytes, n, gapMs) {
  const rtts = [];
  for (let i = 0; i < n; i++) {
    if (gapMs > 0) await new Promise((r) => setTimeout(r, gapMs));
    const buf = new Uint8Array(bytes); buf[0] = i & 255;
    const p = new Promise((r) => waiters.set(kind, r));
    const t0 = performance.now();
    send(kind, buf.buffer);
    await p;
    rtts.push(performance.now() - t0);
  }
  rtts.sort((a, b) => a - b);
  return { p50: rtts[rtts.length >> 1], p10: rtts[Math.floor(rtts.length * 0.1)], p90: rtts[Math.floor(rtts.length * 0.9)] };
}
self.onmessage = async (ev) => {
  const m = ev.data;
  if (m.cmd === 'caps') postMessage({ caps: { RTCPeerConnection: typeof RTCPeerConnection, RTCDataChannel: typeof RTCDataChannel } });
  else if (m.cmd === 'ws') {
    ws = new WebSocket(m.url); ws.binaryType = 'arraybuffer';
    ws.onmessage = (e) => onData('ws', e.data);
    ws.onopen = () => postMessage({ ok: 'ws' });
  } else if (m.cmd === 'port') { port = m.port; port.onmessage = (e) => onData('port', e.data); postMessage({ ok: 'port' }); }
  else if (m.cmd === 'dc') {
    dc = m.dc; dc.binaryType = 'arraybuffer';
    dc.onmessage = (e) => onData('dc', e.data);
    const done = () => postMessage({ ok: 'dc', state: dc.readyState });
    if (dc.readyState === 'open') done(); else dc.onopen = done;
  }
  else if (m.cmd === 'echo') { echo[m.kind] = true; postMessage({ ok: 'echo' }); }
  else if (m.cmd === 'spin') { spin(m.on); postMessage({ ok: 'spin' }); }
  else if (m.cmd === 'bench') postMessage({ result: await pingpong(m.kind, m.bytes, m.n, m.gap) });
};
