/**
 * "Donate only while charging": the Battery Status API (Window only, not in
 * workers; Chromium has it, Firefox and Safari do not). The page watches the
 * battery and tells the node whether it is on the charger; the node drains
 * while it is not and the donor asked for charging only. Where the API is
 * missing the choice is shown as unavailable and the node donates as usual.
 */

export interface BatteryLike {
  charging: boolean;
  /** 0..1 */
  level: number;
  addEventListener(type: 'chargingchange' | 'levelchange', listener: () => void): void;
}

export interface PowerState {
  /** The Battery Status API answered. */
  available: boolean;
  /** On the charger (true where there is no API: a desktop without a battery reports charging too). */
  charging: boolean;
  level: number | undefined;
}

/**
 * Reads the battery and calls `onChange` now and at every change. Resolves
 * with the first reading; `available: false` when the browser has no API.
 */
export async function watchPower(nav: { getBattery?(): Promise<BatteryLike> }, onChange: (s: PowerState) => void): Promise<PowerState> {
  if (typeof nav.getBattery !== 'function') {
    const s = { available: false, charging: true, level: undefined };
    onChange(s);
    return s;
  }
  let battery: BatteryLike;
  try {
    battery = await nav.getBattery();
  } catch {
    const s = { available: false, charging: true, level: undefined };
    onChange(s);
    return s;
  }
  const read = (): PowerState => ({ available: true, charging: battery.charging, level: battery.level });
  battery.addEventListener('chargingchange', () => onChange(read()));
  battery.addEventListener('levelchange', () => onChange(read()));
  const first = read();
  onChange(first);
  return first;
}
