/**
 * The tracker's one clock (ticker.ts): jobs whose periods are multiples of
 * its beat share its one timer and keep their periods; any other period
 * gets a timer of its own; a stopped job stops; a job that throws does not
 * keep the others of its beat from running.
 */
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { Ticker } from '../../src/tracker/ticker.ts';

describe('Ticker', () => {
  beforeEach(() => vi.useFakeTimers());
  afterEach(() => vi.useRealTimers());

  it('runs jobs at multiples of its beat on one timer, each at its own period', () => {
    const ticker = new Ticker(500);
    const runs = { a: 0, b: 0, c: 0 };
    ticker.every(500, () => runs.a++);
    ticker.every(1000, () => runs.b++);
    ticker.every(5000, () => runs.c++);
    expect(vi.getTimerCount()).toBe(1);
    vi.advanceTimersByTime(10_000);
    expect(runs).toEqual({ a: 20, b: 10, c: 2 });
  });

  it('gives a period that is not a multiple a timer of its own', () => {
    const ticker = new Ticker(500);
    let shared = 0;
    let own = 0;
    ticker.every(500, () => shared++);
    ticker.every(200, () => own++);
    expect(vi.getTimerCount()).toBe(2);
    expect(ticker.size).toBe(1);
    vi.advanceTimersByTime(1000);
    expect({ shared, own }).toEqual({ shared: 2, own: 5 });
  });

  it('stops a job, and its timer with the last one', () => {
    const ticker = new Ticker(500);
    let runs = 0;
    const stopA = ticker.every(500, () => runs++);
    const stopB = ticker.every(1000, () => {});
    vi.advanceTimersByTime(1000);
    stopA();
    vi.advanceTimersByTime(1000);
    expect(runs).toBe(2);
    expect(vi.getTimerCount()).toBe(1);
    stopB();
    expect(vi.getTimerCount()).toBe(0);
  });

  it('runs the rest of a beat when one job throws, and throws its error after', () => {
    const ticker = new Ticker(500);
    let after = 0;
    ticker.every(500, () => {
      throw new Error('boom');
    });
    ticker.every(500, () => after++);
    expect(() => vi.advanceTimersByTime(500)).toThrow('boom');
    expect(after).toBe(1);
  });
});
