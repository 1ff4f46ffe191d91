#!/usr/bin/env node
// Writes the PWA icons (public/icons/*.png, public/icons/icon.svg) from one
// drawing: a ring of nodes joined to a centre, the mesh. PNGs are encoded by
// hand (zlib + CRC) so no image package is needed; rerun after a change.
import { deflateSync } from 'node:zlib';
import { mkdirSync, writeFileSync } from 'node:fs';

const BG = [15, 23, 42];
const FG = [56, 189, 248];
const NODES = 6;

function crc32(buf) {
  let c;
  const table = crc32.table ??= Array.from({ length: 256 }, (_, n) => {
    c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  let crc = 0xffffffff;
  for (const b of buf) crc = table[(crc ^ b) & 0xff] ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}

function chunk(type, data) {
  const len = Buffer.alloc(4);
  len.writeUInt32BE(data.length);
  const td = Buffer.concat([Buffer.from(type, 'ascii'), data]);
  const crc = Buffer.alloc(4);
  crc.writeUInt32BE(crc32(td));
  return Buffer.concat([len, td, crc]);
}

function distToSegment(px, py, ax, ay, bx, by) {
  const dx = bx - ax, dy = by - ay;
  const t = Math.max(0, Math.min(1, ((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy)));
  return Math.hypot(px - (ax + t * dx), py - (ay + t * dy));
}

/** Coverage in [0,1] of the drawing at (x,y) in unit coordinates; `pad` shrinks it for maskable icons. */
function coverage(x, y, pad) {
  const s = 1 - 2 * pad;
  const u = (x - 0.5) / s, v = (y - 0.5) / s;
  const pts = Array.from({ length: NODES }, (_, i) => [0.33 * Math.cos((i * 2 * Math.PI) / NODES - Math.PI / 2), 0.33 * Math.sin((i * 2 * Math.PI) / NODES - Math.PI / 2)]);
  let d = Math.hypot(u, v) - 0.09;
  for (const [px, py] of pts) d = Math.min(d, Math.hypot(u - px, v - py) - 0.065, distToSegment(u, v, 0, 0, px, py) - 0.018);
  for (let i = 0; i < NODES; i++) d = Math.min(d, distToSegment(u, v, ...pts[i], ...pts[(i + 1) % NODES]) - 0.012);
  return Math.max(0, Math.min(1, 0.5 - d * 300));
}

function png(size, pad) {
  const row = size * 4 + 1;
  const raw = Buffer.alloc(row * size);
  for (let y = 0; y < size; y++) {
    raw[y * row] = 0;
    for (let x = 0; x < size; x++) {
      // 2x2 supersampling keeps small icons' edges smooth.
      let a = 0;
      for (const [ox, oy] of [[0.25, 0.25], [0.75, 0.25], [0.25, 0.75], [0.75, 0.75]]) a += coverage((x + ox) / size, (y + oy) / size, pad) / 4;
      const o = y * row + 1 + x * 4;
      for (let c = 0; c < 3; c++) raw[o + c] = Math.round(BG[c] * (1 - a) + FG[c] * a);
      raw[o + 3] = 255;
    }
  }
  const ihdr = Buffer.alloc(13);
  ihdr.writeUInt32BE(size, 0);
  ihdr.writeUInt32BE(size, 4);
  ihdr[8] = 8; ihdr[9] = 6; ihdr[10] = 0; ihdr[11] = 0; ihdr[12] = 0;
  return Buffer.concat([Buffer.from([137, 80, 78, 71, 13, 10, 26, 10]), chunk('IHDR', ihdr), chunk('IDAT', deflateSync(raw, { level: 9 })), chunk('IEND', Buffer.alloc(0))]);
}

function svg() {
  const pts = Array.from({ length: NODES }, (_, i) => [50 + 33 * Math.cos((i * 2 * Math.PI) / NODES - Math.PI / 2), 50 + 33 * Math.sin((i * 2 * Math.PI) / NODES - Math.PI / 2)].map((v) => v.toFixed(2)));
  const col = `rgb(${FG.join(',')})`;
  return `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 100 100"><rect width="100" height="100" rx="18" fill="rgb(${BG.join(',')})"/><g stroke="${col}" fill="${col}">${pts.map(([x, y], i) => `<line x1="50" y1="50" x2="${x}" y2="${y}" stroke-width="3.6"/><line x1="${x}" y1="${y}" x2="${pts[(i + 1) % NODES][0]}" y2="${pts[(i + 1) % NODES][1]}" stroke-width="2.4"/><circle cx="${x}" cy="${y}" r="6.5"/>`).join('')}<circle cx="50" cy="50" r="9"/></g></svg>\n`;
}

mkdirSync('public/icons', { recursive: true });
writeFileSync('public/icons/icon-192.png', png(192, 0));
writeFileSync('public/icons/icon-512.png', png(512, 0));
writeFileSync('public/icons/maskable-512.png', png(512, 0.1));
writeFileSync('public/icons/apple-touch-icon.png', png(180, 0.05));
writeFileSync('public/icons/icon.svg', svg());
console.log('icons written to public/icons/');
